"""The online path: the engine every question goes through (`engine`), its scheduler, the
runtime it answers with, conversations, `ragkv batch`, the answer it returns, and the facade
`QueryEngine` (`query`) that `ragkv.open()` gives. Above retrieval and loading."""
