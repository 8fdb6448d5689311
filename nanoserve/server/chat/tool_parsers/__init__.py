"""Tool calls in generated text (the OpenAI `tools` API), in the formats of the families we serve:
one module per format (`hermes`, `llama3_json`, `mistral`), over the types every parser returns
(`calls`) and the streaming JSON scanner they share (`json_scanner`); `registry` names the formats
and picks one for a model.

A parser is fed one sequence's text deltas and returns what to send: content text, which never
holds any part of a call (a suffix that may still begin one is held back, as a stop string is),
and `ToolCallDelta`s as OpenAI streams them: a call's first delta carries its name (and empty
arguments), the next ones carry its arguments text as it arrives. A call is committed once its
text reads `{"name": "<name>", "arguments": {` (or `"parameters"`; in the Mistral v11 form
`name[ARGS]{`); from then on its arguments are the arguments object exactly as generated (cut
short if generation was), and joining the deltas of a call gives them. Text that looks like a call
but is not of that shape is held to the end of the call and decoded whole; if it is not a call
either, it is content, exactly as generated. Once a call has been seen, whitespace-only content
(the newlines between calls) is dropped.

Invariant: the result does not depend on how the text is split into deltas, so a non-streamed
response (the whole text pushed at once) carries the same calls as the joined deltas of a stream.
"""
