"""Developer tools that ship with the package (they use only public APIs)."""
