"""What the gateway knows about each replica apart from latency: its load (`load`), whether
it is ejected for failing (`outliers`), which LoRA adapters it holds (`adapters`), and the
runtime adapter API calls that load them (`engine_api`)."""
