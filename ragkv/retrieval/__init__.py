"""Finding the chunks for a question: the first stage (`search`: dense, lexical, hybrid), the
retriever that widens, filters and fits them (`retriever`), and the rerank over stored KV
(`rerank`). Above ragkv.loading, which the rerank reads KV through."""
