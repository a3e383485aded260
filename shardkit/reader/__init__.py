"""Readers: a dataset URL plus a shard -> batches of numpy arrays (see DESIGN.md, the reader contracts)."""
