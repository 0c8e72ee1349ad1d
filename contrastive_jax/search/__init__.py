"""Search over an embedding index: its on-disk format, exact search, the FAISS ANN index and the
searcher that chooses between them. Needs no checkpoint code, so a search service imports it
alone."""
