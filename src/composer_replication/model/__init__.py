"""The policy model: loading and conversion, the forward pieces the losses use (hidden states, the head), prefix sharing and packed attention, devices and memory."""
