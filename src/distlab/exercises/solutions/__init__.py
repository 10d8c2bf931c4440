"""The exercises' solutions, one module a chapter: what each page shows in its collapsed answer, and what the
book's build and the tests grade, so an answer on a page is never wrong.

May import: runtime, errors, comm, parallel, predict, measure, models, data, exercises.
"""
