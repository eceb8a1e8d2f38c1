"""The doors other tools come in by, each thin over `starqa.api`: `http` (the OpenAI chat API,
`starqa serve --http`) and `mcp` (a Model Context Protocol server over stdio, `starqa mcp`).
Their libraries (starlette, uvicorn, the MCP SDK) are imported by these modules only."""
