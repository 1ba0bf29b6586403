"""What each replica's KV cache holds, exactly, for precise prefix routing: the prompt's
block hashes as vLLM computes them (`kv_hashes`), the index fed by the engines' KV events
(`kv_events`), and the subscriptions kept equal to the ready replicas (`precise_routing`).
The scorer that reads it is `scorers/precise.py`; the approximate prefix index is
`scorers/prefix.py`."""
