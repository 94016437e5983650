"""The engine side: the llama.cpp binding (the only importer of llama_cpp), the
scheduler thread that owns the context, the executor, the planner, lanes, sampling."""
