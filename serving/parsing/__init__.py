"""Parsing a chat model's output text: tool calls (``--tool-call-parser``) and reasoning
(``--reasoning-parser``), with SGLang's parser names. Pure Python on text: the HTTP routes use it
(serving/server/chat_output.py), nothing here imports an HTTP framework or the engine."""
