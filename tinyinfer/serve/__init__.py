"""The OpenAI-compatible HTTP server: the app and its routes (server), the engine thread
(loop), request and response shapes (schemas, responses), chat templates (chat), metrics."""
