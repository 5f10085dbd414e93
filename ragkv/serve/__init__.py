"""The HTTP fronts: `ragkv serve`'s OpenAI-compatible service, the front over vLLM, what they
share (`api`) and the guard in front of every route. Above the engine."""
