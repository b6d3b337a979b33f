"""Knowledge-recovery distillation: the student (SwiftKV on) learns the teacher's (SwiftKV off)
next-token distributions. The pieces a Ray Train worker runs; ``ray_jobs/distill.py`` drives them."""
