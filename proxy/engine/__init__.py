"""The engine side: the llama.cpp binding (the only importer of llama_cpp) and the rooms
of the engine thread that owns the context, in the order a request meets them: build,
admission, planner, restore (with placement and publishing), the step (executor, steps,
speculation, drafting), emit, streams, accounting; job and lanes are what they share;
types and tokens are the HTTP side's contract."""
