"""``kbd mcp``: a session's knowledge tools over the Model Context Protocol
(:mod:`.server`)."""
