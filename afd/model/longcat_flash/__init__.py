"""LongCat-Flash (`model_type: longcat_flash`): shortcut-connected MoE with MLA and identity experts."""
