"""The vLLM backend of extraction: version gate, engine or server launch, conversion of vLLM's files to shards."""
