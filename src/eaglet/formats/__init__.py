"""The serving formats of a draft head: EAGLE (vLLM, SGLang) and speculators (vLLM).

`eagle` and `speculators` say what each format holds; `writer` writes a head and checks what it wrote;
`contract` checks a folder as the servers would read it (`server_names`: the tensor names they load);
`reader` loads a head back from either format; `folder` names the two files every format folder holds.
"""
