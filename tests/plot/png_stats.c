// Size and colours of a PNG, read with cairo, for the tests of `moe plot` (tests/cli/test_plot.sh):
//   png_stats FILE.png [RRGGBB]
// prints "WIDTH HEIGHT COLOURS INKED NEAR": the distinct colours, the pixels that are not the white
// background, and the pixels within 48 of colour RRGGBB in each channel (0 without one). Exits 1
// with a message when FILE is not a PNG that cairo reads.
#include <cairo.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

static int compare(const void *a, const void *b) {
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return (x > y) - (x < y);
}

static int channel_near(uint32_t a, uint32_t b, int shift) {
    int d = (int)((a >> shift) & 0xff) - (int)((b >> shift) & 0xff);
    return d >= -48 && d <= 48;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: png_stats FILE.png [RRGGBB]\n");
        return 2;
    }
    cairo_surface_t *s = cairo_image_surface_create_from_png(argv[1]);
    if (cairo_surface_status(s)) {
        fprintf(stderr, "%s: %s\n", argv[1], cairo_status_to_string(cairo_surface_status(s)));
        return 1;
    }
    int w = cairo_image_surface_get_width(s), h = cairo_image_surface_get_height(s);
    int stride = cairo_image_surface_get_stride(s);
    uint32_t want = argc > 2 ? (uint32_t)strtoul(argv[2], NULL, 16) : 0;
    const unsigned char *data = cairo_image_surface_get_data(s);
    uint32_t *px = malloc((size_t)w * (size_t)h * sizeof(uint32_t) + 1);
    size_t n = 0, inked = 0, near = 0, colours = 0;
    for (int y = 0; y < h; y++)
        for (int x = 0; x < w; x++) {
            uint32_t p = ((const uint32_t *)(data + (size_t)y * (size_t)stride))[x] & 0xffffff;
            px[n++] = p;
            inked += p != 0xffffff;
            near += argc > 2 && channel_near(p, want, 16) && channel_near(p, want, 8) && channel_near(p, want, 0);
        }
    qsort(px, n, sizeof(uint32_t), compare);
    for (size_t i = 0; i < n; i++) colours += i == 0 || px[i] != px[i - 1];
    printf("%d %d %zu %zu %zu\n", w, h, colours, inked, near);
    free(px);
    cairo_surface_destroy(s);
    return 0;
}
