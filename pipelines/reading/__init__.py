"""Documents into chunks: reading files and trees (text, HTML, JSONL, PDF, Word, PowerPoint) into
blocks with their places, and splitting them into chunks of at most so many tokens."""
