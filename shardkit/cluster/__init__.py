"""Job config -> roles -> processes on an engine (not yet built: issues 5 and 6)."""
