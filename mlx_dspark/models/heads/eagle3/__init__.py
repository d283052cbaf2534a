"""An EAGLE-3 draft (speculators layout): its config fields checked by name (`args`) and the draft layer over the target's three tapped states (`model`)."""
