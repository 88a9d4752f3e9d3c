"""What every role's worker builds on: the lifecycle (``core``: bus, card, load reports, drain), the
KV engine's parts (``base``: engine thread, KV events, step outputs), the settings (``settings``)."""
