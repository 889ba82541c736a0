"""Chat templates with tool roles, written for these tests in the two shapes models use.

`CHATML_TOOLS`, Qwen3's shape: ChatML, the tools' schemas in the system block, an
assistant's ``tool_calls`` as ``<tool_call>`` JSON blocks, consecutive ``tool`` messages in
one user block of ``<tool_response>``s, an empty think block in the generation prompt when
``enable_thinking`` is false, and the reasoning of every assistant turn but the last
dropped (it rewrites its history, as Qwen3's does for turns before the last question).

`HEADER_TOOLS`, Llama 3.1's shape: header roles, trimmed content, ``<|eot_id|>`` after every
message, a ``tool`` message under its own ``ipython`` header.
"""

CHATML_TOOLS = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
    {{- 'You may call these tools:\\n<tools>' }}
    {%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
    {{- '\\n</tools>\\nCall one as <tool_call>\\n{\"name\": ..., \"arguments\": ...}\\n'
        '</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set content = message.content or '' %}
        {%- if '</think>' in content and not loop.last %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {{- '<|im_start|>assistant\\n' + content }}
        {%- for call in message.tool_calls or [] %}
            {%- if content or not loop.first %}{{- '\\n' }}{%- endif %}
            {{- '<tool_call>\\n{\"name\": \"' + call.function.name + '\", \"arguments\": ' }}
            {{- call.function.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""

HEADER_TOOLS = """{{- bos_token }}
{%- if tools %}
    {{- '<|start_header_id|>system<|end_header_id|>\\n\\nTools:' }}
    {%- for tool in tools %}{{- ' ' + tool.function.name }}{%- endfor %}
    {{- '<|eot_id|>' }}
{%- endif %}
{%- for message in messages %}
    {%- set role = 'ipython' if message.role == 'tool' else message.role %}
    {{- '<|start_header_id|>' + role + '<|end_header_id|>\\n\\n' }}
    {%- if message.tool_calls %}
        {%- for call in message.tool_calls %}
            {{- '{\"name\": \"' + call.function.name + '\", \"parameters\": ' }}
            {{- call.function.arguments | tojson }}{{- '}' }}
        {%- endfor %}
    {%- else %}
        {{- message.content | trim }}
    {%- endif %}
    {{- '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}"""

CHATML_SPECIAL = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
HEADER_SPECIAL = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
