"""The daemon (``kbd serve``): the composition root, the listening socket, the
HTTP protocol and its limits, the API routes, the exec broker, the access log
and journald. Only this package imports the API stack (FastAPI, uvicorn)."""
