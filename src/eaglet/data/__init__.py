"""Conversation data: loading JSONL conversations and chat-templating them into token ids with a loss mask."""
