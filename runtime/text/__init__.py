"""tierflow.runtime.text: text to tokens and back; chat templates and tool calls.

    tokenizer.py        llama.cpp's tokenizer (vocab_only); special_tokens.py the special tokens' roles
    vocabulary.py       checks a vocabulary before llama.cpp loads it
    chat_template.py    chat templates rendered in a sandbox (template_guards.py, template_worker.py)
    template_choice.py  which template chats use: the file's, a Jinja file, or a llama.cpp built-in name
    tool_prompt.py      tools and tool history for the template; the generic fallback
    tool_calls.py       the model's tool calls parsed from its text, per format; the streaming splitter
    text_stream.py      token bytes to text pieces, stop strings
"""
