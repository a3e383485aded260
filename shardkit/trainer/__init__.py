"""What a training script imports: context, checkpoints, strategy helpers (not yet built: issue 5)."""
