"""Model file readers and writers."""
