"""Chat output post-processing: reasoning and tool calls parsed out of a reply, streamed; the
registries that name the parsers' formats; the grammars that force a tool call or end a reasoning
section."""
