"""The browser pages: the chat page and the live engine dashboard (static files in `static/`)."""
