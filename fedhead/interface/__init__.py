"""What the commands share: options derived from the experiment's fields, one-line usage errors, result tables."""
