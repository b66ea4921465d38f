"""Hidden-state extraction: conversations -> (regenerated) -> tokens -> target forward -> shards."""
