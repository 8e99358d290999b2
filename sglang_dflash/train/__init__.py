"""Drafter training: anchors and block masks, the position-decayed loss, the training loop."""
