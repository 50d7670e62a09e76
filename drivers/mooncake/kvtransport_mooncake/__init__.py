"""kvtransport drivers over the Mooncake transfer engine (mooncake-gdr, mooncake-staged)."""
