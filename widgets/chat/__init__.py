"""The chat's views: bubbles of coloured tokens, markdown, the prompt box, the conversation list."""
