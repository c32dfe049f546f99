"""What a job keeps (checkpoints, the resume agreement, the config it agreed on), and how it stops
(preemption) and comes back.
"""
