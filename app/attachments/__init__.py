"""Files in a chat: read into text with stated limits, put into the prompt whole when they fit, else the passages
a question needs (BM25 over line chunks), and answers that rewrite a file turned into a diff and a patched file.

Pure Python (pypdf for PDFs); no gradio. One room a job: `reading` (bytes and paths -> `Attachment`, typed errors),
`rendering` (a file or its passages in a user turn), `retrieval` (fit the context, else the passages that answer),
`diffs` (answers that rewrite a file), and `turns` (a chat's turns with their files as the model sees them: the one
function the chat tab, the CLI and the API build their prompts with).

Errors are typed (`AttachmentError` and its subclasses), each naming the file and what to do about it.
"""

from app.attachments.diffs import DIFF_MIN_RATIO, FileDiff, code_blocks, diffs
from app.attachments.reading import (LIMITS, MAX_FILE_BYTES, MAX_FILES, MAX_PDF_PAGES, MAX_TEXT_CHARS, Attachment,
                                     AttachmentError, BinaryFile, EmptyFile, FileTooLarge, Limits, PdfWithoutText,
                                     TooManyFiles, UnreadableFile, UnsupportedEncoding, check_count, clean_name,
                                     format_bytes, from_bytes, read_path, read_paths, unique_names)
from app.attachments.rendering import RETRIEVAL_NOTE, Part, fenced, language, render, render_part, render_whole
from app.attachments.retrieval import (ANSWER_MARGIN, BM25, CHUNK_CHARS, CHUNK_LINES, Budget, ContextPlan,
                                       answer_reserve, chunks, estimate_tokens, fit, plan_context, terms)
from app.attachments.turns import ChatPrompt, Window, chat_prompt, message_files, task_files, task_prompt

__all__ = ["Attachment", "AttachmentError", "TooManyFiles", "FileTooLarge", "EmptyFile", "BinaryFile",
           "UnreadableFile", "UnsupportedEncoding", "PdfWithoutText", "Limits", "LIMITS", "MAX_FILE_BYTES",
           "MAX_TEXT_CHARS", "MAX_FILES", "MAX_PDF_PAGES", "CHUNK_LINES", "CHUNK_CHARS", "ANSWER_MARGIN",
           "DIFF_MIN_RATIO", "RETRIEVAL_NOTE", "Part", "Budget", "ContextPlan", "BM25", "FileDiff", "from_bytes",
           "read_path", "read_paths", "check_count", "fenced", "render", "render_whole", "render_part", "language",
           "plan_context", "fit", "answer_reserve", "chunks", "terms", "diffs", "code_blocks", "estimate_tokens",
           "format_bytes", "clean_name", "unique_names", "message_files", "chat_prompt", "ChatPrompt", "Window",
           "task_prompt", "task_files"]
