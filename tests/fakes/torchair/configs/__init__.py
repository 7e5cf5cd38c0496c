"""Fake torchair.configs (tests only): the CompilerConfig options afd may set."""
