"""Pictures in, detections out, for apps that send images rather than tensors: the boxes a
detector found and what is done to them (`boxes`: class-aware NMS, the top rows, Frigate's
20x6 answer, DeepStack's pixel boxes), the decoders from each detector family's raw outputs
to boxes (`decoders`), label maps (`labels`), pictures into a model's input (`images`:
Pillow, imported when used) and the picture settings a config holds (`settings`: no numpy).
The bottom of edged/, below selection."""
