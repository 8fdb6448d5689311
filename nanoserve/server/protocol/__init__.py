"""The wire: OpenAI request and response models (`openai`), Anthropic Messages request models
(`anthropic`), errors in OpenAI's or Anthropic's shape (`errors`) and Server-Sent Events (`sse`)."""
