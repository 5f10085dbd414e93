"""The chunk index of a generation: immutable segments of vectors (FAISS) and of words (BM25),
searched together."""
