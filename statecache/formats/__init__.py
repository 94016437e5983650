"""How checkpoints are laid out where they are stored: files on disk, entries in the
shared store, KV pages, their compression, and the key that signs them."""
