from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kronk_wsgi.engine._draw",
            ["kronk_wsgi/engine/_draw.c"],
            # Sums may be reordered (so they vectorise); infinities and NaN keep their meaning.
            extra_compile_args=["-O3", "-fno-math-errno", "-fno-trapping-math", "-fno-signed-zeros",
                                "-fassociative-math"],
        ),
    ],
)
