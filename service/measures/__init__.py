"""The mixing measures (SPEC §6): how much each input token contributes to each output position."""
