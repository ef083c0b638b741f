"""The OpenAI-compatible HTTP gateway (`zeroserve gateway`): services/gateway/app.py."""
