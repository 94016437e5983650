"""Where checkpoints are held: RAM, disk and the shared store (Redis/Valkey)."""
