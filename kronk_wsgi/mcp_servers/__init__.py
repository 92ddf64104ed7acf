"""The operator's MCP servers: a host process that keeps their sessions (host.py), and a worker's view of their tools (client.py)."""
