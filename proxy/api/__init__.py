"""The HTTP side: one module per API for parsing, one for writing its events,
shared chat-template rendering and reply parsing, and the aiohttp app."""
