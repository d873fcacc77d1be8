"""The optional compiled part of Turnstile (everything else is in pyproject.toml).

`turnstile.proxy._tokenscan` reads token ids and logprobs straight from a backend's
answer. It is built by `pip install` with the machine's C compiler; where there is none
the install goes on without it and Turnstile decodes answers in Python
(`turnstile.proxy.tokens` says which is in use).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "turnstile.proxy._tokenscan",
            sources=["turnstile/proxy/_tokenscan.c"],
            extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wextra"],
            optional=True,
        )
    ]
)
