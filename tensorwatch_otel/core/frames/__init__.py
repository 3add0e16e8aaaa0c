"""Where frames come from: the hooks placed on a model (attach), the recorder that turns a
module call into a frame, compiled graphs' sites and ops, torch.func transforms, offloaded
weights, deep copies of hooked modules, the backward's frames (`gradients=True`), the finite
checks of outputs, and the parameter index the hooks keep."""
