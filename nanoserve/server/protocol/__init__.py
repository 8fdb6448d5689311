"""The wire: OpenAI request and response models (`openai`), OpenAI-shaped errors (`errors`) and
Server-Sent Events (`sse`)."""
