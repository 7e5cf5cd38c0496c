"""afd's one configuration, the ground floor of the house: the cluster YAML's schema and what each field
declares (its flag, rule and docs), the loader, the flags generated from the fields, expert placement and
the attention TP layout. It imports nothing of afd but afd/quant."""
