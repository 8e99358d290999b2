"""SGLang integration (plugin, worker, draft model). Imported by SGLang's plugin loader only."""
