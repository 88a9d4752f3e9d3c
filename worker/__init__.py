"""The worker base every role's worker builds on: bus, card, engine thread, load reports."""
